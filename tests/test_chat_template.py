"""tokenmill.chat_template: the same text as transformers' apply_chat_template, and hostile templates refused
quickly instead of eating seconds and gigabytes."""
import inspect
import time

import jinja2
import pytest

from tokenmill.chat_template import (DEFAULT_MAX_CHARS, DEFAULT_TIMEOUT_S, ChatTemplateError, _compile,
                                     render_chat_template)

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi there é 漢字"}],
    "system+user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    "full": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "4.  "}, {"role": "user", "content": "And 3+3?"},
             {"role": "assistant", "content": "It is"}],
}
FLAGS = [dict(add_generation_prompt=True), dict(add_generation_prompt=False),
         dict(add_generation_prompt=False, continue_final_message=True)]

# Templates written for these tests in the styles real models use: tools as JSON, a namespace scan for the last
# user turn, reasoning, loop controls, `~` and `%`, whitespace control, {% generation %}, raise_exception.
TOOLS_TEMPLATE = """
{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}
{%- endif %}{{- "# Tools\\n<tools>" }}{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
  {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
  {%- if m.role == 'system' and loop.first %}{%- continue %}{%- endif %}
  {{- '<|im_start|>' ~ m.role ~ '\\n' }}
  {%- if m.reasoning_content is defined and loop.index0 > ns.last_user %}
    {{- '<think>\\n' ~ m.reasoning_content | trim ~ '\\n</think>\\n\\n' }}
  {%- endif %}
  {% generation %}{{- m.content | trim }}{% endgeneration %}
  {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
  {%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
HEADER_TEMPLATE = """{{- bos_token }}{%- set year = strftime_now("%Y") %}
{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = "" %}{%- set rest = messages %}{%- endif %}
{{- "<|header|>system<|end|>\\n\\nYear: %s, %d turns\\n" % (year, rest | length) }}{{ system }}{{ "<|eot|>" }}
{% for m in rest %}
{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('roles must be user or assistant') }}{% endif %}
{{ "<|header|>" + m['role'] + "<|end|>\\n\\n" + m['content'] | trim + "<|eot|>" }}
{% endfor %}
{%- set users = rest | selectattr('role', 'equalto', 'user') | map(attribute='content') | list %}
{{- '<|users|>' ~ users | join(' / ') ~ '<|eot|>' if users | length > 1 else '' }}
{%- if add_generation_prompt %}{{ "<|header|>assistant<|end|>\\n\\n" }}{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny("llama"))


@pytest.fixture(scope="module")
def default_tokenizer():
    from transformers import AutoTokenizer

    from tokenmill.models.resolution import resolve_model_path

    try:
        return AutoTokenizer.from_pretrained(resolve_model_path(None))
    except (RuntimeError, ValueError, ImportError) as e:
        pytest.skip(f"default model unavailable: {e}")


_OWN_PARAMS = ("chat_template", "add_generation_prompt", "continue_final_message", "tools")


def _both(tokenizer, conversation, **kw):
    """Our text and transformers'; kw as apply_chat_template takes them (template variables among them)."""
    variables = {k: v for k, v in kw.items() if k not in _OWN_PARAMS}
    ours = render_chat_template(tokenizer, conversation, **{k: v for k, v in kw.items() if k in _OWN_PARAMS},
                                template_kwargs=variables)
    kw.setdefault("add_generation_prompt", True)
    theirs = tokenizer.apply_chat_template(conversation, tokenize=False, **kw)
    return ours, theirs


@pytest.mark.parametrize("flags", FLAGS, ids=["gen-prompt", "no-gen-prompt", "continue"])
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("which", ["default", "tiny"])
def test_same_text_as_transformers(which, conv, flags, request):
    tokenizer = request.getfixturevalue(f"{which}_tokenizer")
    ours, theirs = _both(tokenizer, CONVERSATIONS[conv], **flags)
    assert ours == theirs


@pytest.mark.parametrize("template", [TOOLS_TEMPLATE, HEADER_TEMPLATE], ids=["tools", "header"])
@pytest.mark.parametrize("flags", FLAGS, ids=["gen-prompt", "no-gen-prompt", "continue"])
def test_same_text_as_transformers_on_rich_templates(tiny_tokenizer, template, flags):
    # "reasoning" reaches templates as reasoning_content too; trailing spaces that a template trims must not
    # survive continue_final_message; None values are dropped.
    conv = CONVERSATIONS["full"][:-1] + [{"role": "assistant", "content": "Let me see.  ",
                                          "reasoning": "  add them  ", "tool_calls": None}]
    for kw in (dict(tools=TOOLS), dict(enable_thinking=False), {}):
        ours, theirs = _both(tiny_tokenizer, conv, chat_template=template, **flags, **kw)
        assert ours == theirs, kw


def test_template_errors_are_the_templates():
    conv = [{"role": "tool", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="roles must be user or assistant"):
        render_chat_template(None, conv, chat_template=HEADER_TEMPLATE)


@pytest.mark.parametrize("kwargs, match", [
    (dict(chat_template=None), "no chat template"),
    (dict(chat_template="{% for %}"), "syntax error"),
    (dict(chat_template="x", continue_final_message=True), "cannot both be true"),
    (dict(chat_template="x", template_kwargs={"messages": []}), "cannot set messages"),
    (dict(chat_template="x", template_kwargs=["max_chars"]), "must be a mapping"),
])
def test_bad_input_is_a_clear_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        render_chat_template(None, [{"role": "user", "content": "x"}], **kwargs)


def test_compiled_templates_are_cached():
    assert _compile(HEADER_TEMPLATE) is _compile(HEADER_TEMPLATE)


def test_sandbox_refuses_private_attributes():
    conv = [{"role": "user", "content": "x"}]
    for template in ("{% set ns = namespace(_secret=1) %}", "{{ ''.__class__.__mro__ }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            render_chat_template(None, conv, chat_template=template)
    assert render_chat_template(None, conv, chat_template="{{ messages.__class__ }}") == ""  # undefined


HOSTILE = {
    "string repetition": "{% set x = 'a' * 500000000 %}",
    "list repetition": "{% set x = [0] * 500000000 %}",
    "range": "{{ range(1000000000) | list | length }}",
    "4 MB of output": "{% for i in range(4000) %}{{ 'x' * 1000 }}{% endfor %}",
    "doubling concatenation": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                              "{% endfor %}",
    "doubling addition": "{% set ns = namespace(s=['ab']) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                         "{% endfor %}",
    "quadratic accumulation": "{% set ns = namespace(s='') %}{% for i in range(100000) %}"
                              "{% set ns.s = ns.s + 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' %}{% endfor %}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over a string": "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "center filter": "{{ 'a' | center(500000000) }}",
    "center method": "{{ 'a'.center(500000000) }}",
    "replace": "{{ ('a' * 1000) | replace('a', 'b' * 100000) }}",
    "percent width": "{{ '%0500000000d' % 1 }}",
    "format width": "{{ '{:>500000000}'.format(1) }}",
    "one string many times": "{% set l = ['x' * 1000000] * 100 %}{{ l }}",
    "join of repeats": "{% set l = ['x' * 1000000] * 100 %}{{ l | join }}",
    "tojson of repeats": "{{ dict.fromkeys(range(1000), 'x' * 100000) | tojson }}",
    "power": "{{ 10 ** 100000000 }}",
    "sum of lists": "{{ ([[1]] * 100000) | sum(start=[]) | length }}",
    "batch padding": "{{ [1] | batch(500000000, 0) | list }}",
}


@pytest.mark.parametrize("template", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_templates_fail_fast(template):
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="chat template .*(exceeds|limit)"):
        render_chat_template(None, [{"role": "user", "content": "x"}], chat_template=template)
    # Unbounded, each of these takes seconds to forever and up to gigabytes; bounded they stop within
    # milliseconds. The bound here is generous so a busy machine cannot fail it.
    assert time.perf_counter() - t0 < 3.0


def test_exponential_macro_recursion_stops_at_the_time_limit():
    bomb = ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}")
    with pytest.raises(ChatTemplateError, match="exceeds"):
        render_chat_template(None, [{"role": "user", "content": "x"}], chat_template=bomb, timeout_s=0.3)


def test_long_legitimate_conversation_renders(default_tokenizer):
    conv = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 50} for i in range(400)]
    ours, theirs = _both(default_tokenizer, conv)
    assert ours == theirs and len(ours) > 200_000


def test_server_answers_a_hostile_request_template_with_400(tiny_tokenizer):
    from tokenmill.serve.chat import render_chat
    from tokenmill.http.errors import APIError
    from tokenmill.serve.protocol import ChatMessage

    messages = [ChatMessage(role="user", content="Hi")]
    assert render_chat(tiny_tokenizer, messages).text == render_chat_template(tiny_tokenizer, [{"role": "user",
                                                                                               "content": "Hi"}])
    with pytest.raises(APIError) as e:
        render_chat(tiny_tokenizer, messages, chat_template=HOSTILE["string repetition"])
    assert e.value.status == 400 and "exceeds the limit" in e.value.message


def test_template_kwargs_are_template_variables_only():
    """Issue 29: a request's chat_template_kwargs arrived as **kwargs, so `max_chars` and `timeout_s` lifted the
    sandbox's budgets. Named like any parameter of the render, a kwarg is now a variable (or refused)."""
    conv = [{"role": "user", "content": "x"}]
    for name in inspect.signature(render_chat_template).parameters:
        kwargs = {name: "value of " + name}
        if name in ("tools", "add_generation_prompt"):
            with pytest.raises(ChatTemplateError, match=f"cannot set {name}"):
                render_chat_template(None, conv, chat_template="x", template_kwargs=kwargs)
        else:
            text = render_chat_template(None, conv, chat_template=f"{{{{ {name} }}}}", template_kwargs=kwargs)
            assert text == "value of " + name
    with pytest.raises(ChatTemplateError, match="exceeds the limit of 2,097,152"):
        render_chat_template(None, conv, chat_template="{{ 'x' * 3000000 }}",
                             template_kwargs={"max_chars": 10**9, "timeout_s": 10**9})


def test_server_render_budgets_are_the_server_flags(tiny_tokenizer):
    from tokenmill import cli
    from tokenmill.serve.args import request_limits
    from tokenmill.serve.chat import render_chat
    from tokenmill.http.errors import APIError
    from tokenmill.serve.protocol import ChatMessage, RequestLimits

    default = RequestLimits()
    assert (default.max_chat_template_chars, default.chat_template_timeout) == (DEFAULT_MAX_CHARS, DEFAULT_TIMEOUT_S)
    args = cli.build_parser("serve").parse_args(["serve", "--max-chat-template-chars", "100",
                                                 "--chat-template-timeout", "0.5"])
    limits = request_limits(args)
    assert (limits.max_chat_template_chars, limits.chat_template_timeout) == (100, 0.5)
    messages = [ChatMessage(role="user", content="Hi")]
    assert render_chat(tiny_tokenizer, messages, chat_template="{{ 'x' * 100 }}", limits=limits).text == "x" * 100
    with pytest.raises(APIError) as e:
        render_chat(tiny_tokenizer, messages, chat_template="{{ 'x' * 101 }}", limits=limits,
                    template_kwargs={"max_chars": 10**9})
    assert e.value.status == 400 and "exceeds the limit of 100" in e.value.message

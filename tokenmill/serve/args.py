"""`tokenmill serve`'s own flags (the HTTP server, tool calling, request limits); the engine's are
EngineConfig.add_cli_args, and fleet/serve_command.py puts the two together. Kept apart from api_server.py so
that checking a serve command line imports no server."""
from __future__ import annotations

import argparse
import os

from tokenmill.http.auth import ADMIN_KEY_HELP
from tokenmill.http.body_limit import add_body_args
from tokenmill.http.cors import add_cors_args
from tokenmill.multimodal.media import MediaPolicy
from tokenmill.serve.protocol import RequestLimits
from tokenmill.serve.reasoning import PARSERS as REASONING_PARSERS
from tokenmill.serve.tool_parsers import TOOL_PARSERS


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    _add_server_args(g)
    _add_tool_args(g)
    _add_process_args(g)
    add_cors_args(p)
    _add_limit_args(p.add_argument_group("request limits (each one exceeded is a 400 naming it)"))
    _add_media_args(p.add_argument_group("images (a vision-language model's image_url content parts)"))


def _add_media_args(g) -> None:
    d = MediaPolicy()
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="allow file:// image URLs inside DIR (default: refused)")
    g.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="allow http(s) image URLs to these hosts (default: none; the server connects nowhere a "
                        "request names; redirects to another host are never followed)")
    g.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes, help="largest image file, in bytes")
    g.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                   help="largest image, in decoded pixels (width x height)")
    g.add_argument("--media-fetch-timeout", type=float, default=d.fetch_timeout_s,
                   help="seconds for fetching one http(s) image, redirects included")


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    return MediaPolicy(getattr(args, "allowed_local_media_path", None),
                       tuple(h.lower() for h in getattr(args, "allowed_media_domains", None) or ()),
                       getattr(args, "max_image_bytes", MediaPolicy.max_image_bytes),
                       getattr(args, "max_image_pixels", MediaPolicy.max_image_pixels),
                       getattr(args, "media_fetch_timeout", MediaPolicy.fetch_timeout_s))


def _add_server_args(g) -> None:
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (default: $TOKENMILL_API_KEY)")
    g.add_argument("--admin-key", default=os.environ.get("TOKENMILL_ADMIN_KEY"), help=ADMIN_KEY_HELP)
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 + Retry-After while this many sequences (prompts x n of each request) wait for "
                        "the engine; a request carrying more than this gets 400 (default: no limit)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served under their own model names; needs --enable-lora")
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template overriding the tokenizer's: a file path, the template itself, or a "
                        "shipped one by name (hermes_tools: ChatML with tool calls, for --tool-call-parser hermes)")


def _add_tool_args(g) -> None:
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice 'auto' (OpenAI's default with tools): the model decides whether to call "
                        "tools, and its output is read with --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls (hermes: Qwen/Hermes <tool_call>; llama3_json; mistral "
                        "[TOOL_CALLS]); 'required' and named tool_choice need no parser")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a thinking model's output: its reasoning goes to message.reasoning_content (and "
                        "reasoning), streamed as such deltas, and to a Responses reasoning item; tool calls and "
                        "structured output apply to what follows it (qwen3: the model opens <think>...</think>; "
                        "deepseek_r1: the chat template opens it; openai_gptoss: gpt-oss's harmony channels, analysis "
                        "the reasoning and final the answer)")


def _add_process_args(g) -> None:
    g.add_argument("--enable-request-timing", action="store_true",
                   help="each generation response carries its server-side timing in milliseconds (queue, prefill, "
                        "decode, detokenize, total): a Server-Timing header, and for streams a `timing` field on "
                        "the last chunk before [DONE]; `tokenmill router` adds its own time to the header")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own logging ('info' logs every request)")
    g.add_argument("--engine-start-timeout", type=float, default=900.0,
                   help="seconds to wait for the engine process to load the model")
    g.add_argument("--no-dashboard", action="store_true",
                   help="do not serve the live dashboard at /dashboard (nor record per-step stats for it)")
    g.add_argument("--install-default-model", action="store_true",
                   help="pip-install the built-in default model if it is missing")


def _add_limit_args(lim) -> None:
    d = RequestLimits()
    lim.add_argument("--max-n", type=int, default=d.max_n,
                     help="largest n (and best_of) of one request; never more than --max-num-seqs")
    lim.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                     help="most prompts in one /v1/completions request (a list of strings or of token-id lists)")
    lim.add_argument("--max-sequences-per-request", type=int, default=d.max_sequences_per_request,
                     help="most sequences (prompts x n) in one request; each is an engine request")
    add_body_args(lim)
    lim.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                     help="most stop strings (and stop_token_ids) one request may list")
    lim.add_argument("--max-stop-string-length", type=int, default=d.max_stop_string_length,
                     help="longest stop string, in characters")
    lim.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias, help="most logit_bias entries")
    lim.add_argument("--max-json-schema-bytes", type=int, default=d.max_json_schema_bytes,
                     help="largest JSON schema, regex or grammar for structured output")
    lim.add_argument("--max-json-schema-depth", type=int, default=d.max_json_schema_depth,
                     help="deepest nesting of a JSON schema for structured output (and of each tool's parameters)")
    lim.add_argument("--max-tools", type=int, default=d.max_tools,
                     help="most tools one chat request may list (OpenAI's bound)")
    lim.add_argument("--max-tools-schema-bytes", type=int, default=d.max_tools_schema_bytes,
                     help="largest total size of one request's tools as JSON (names, descriptions, parameter "
                          "schemas)")
    lim.add_argument("--max-chat-template-chars", type=int, default=d.max_chat_template_chars,
                     help="most characters one chat template render may output, or build in one string or list "
                          "(the sandbox also caps everything it builds at 8x this)")
    lim.add_argument("--chat-template-timeout", type=float, default=d.chat_template_timeout,
                     help="seconds one chat template render may take")


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(max_n=min(args.max_n, args.max_num_seqs), max_stop_strings=args.max_stop_strings,
                         max_stop_string_length=args.max_stop_string_length, max_logit_bias=args.max_logit_bias,
                         max_json_schema_bytes=args.max_json_schema_bytes,
                         max_json_schema_depth=args.max_json_schema_depth, max_tools=args.max_tools,
                         max_tools_schema_bytes=args.max_tools_schema_bytes,
                         max_prompts_per_request=args.max_prompts_per_request,
                         max_sequences_per_request=args.max_sequences_per_request,
                         max_chat_template_chars=args.max_chat_template_chars,
                         chat_template_timeout=args.chat_template_timeout)

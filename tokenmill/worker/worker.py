"""A worker owns one device: the model, its KV cache tensors, and the model runner."""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from tokenmill.config import EngineConfig, kv_cache_torch_dtype
from tokenmill.distributed import init_distributed, stage_layers
from tokenmill.host import release_free_heap, usable_cpus
from tokenmill.kv_transfer import make_worker_connector
from tokenmill.layers import batch_invariant, cpu_linear
from tokenmill.layers.attention import cpu_kernels, get_attention_backend
from tokenmill.layers.attention.kv_quant import KVCacheQuant
from tokenmill.layers.cpu_memory import zeroed_tensors
from tokenmill.models.loader import load_model
from tokenmill.models.resolution import gguf_weights_for, resolve_model_path
from tokenmill.spec_decode import make_proposer
from tokenmill.startup import Ledger
from tokenmill.step.interrupt import StepInterrupt
from tokenmill.step.kv_groups import kv_layout
from tokenmill.worker import kernels_report
from tokenmill.worker.cpu_threads import ThreadSizer
from tokenmill.worker.lora_manager import LoRAManager
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger("tokenmill")

DEFAULT_CPU_KV_BYTES = 4 * 2**30


def collective_timeout_s() -> float:
    """How long a collective waits for a peer (a backstop: executors kill all ranks when one dies)."""
    return float(os.environ.get("TOKENMILL_COLLECTIVE_TIMEOUT_S", "120"))


def init_worker_process(config: EngineConfig, rank: int, init_method: str, local_rank: int = 0,
                        num_threads: Optional[int] = None) -> None:
    """Prepare a rank's own process (mp child, Ray actor) before its Worker is built: its share of the cores
    (default: this machine's, split between the ranks), its device, the torch.distributed world, and model paths
    valid on this node."""
    pc = config.parallel
    if config.device == "cuda":
        torch.cuda.set_device(local_rank)
    else:  # one thread per core in every rank would time-slice the ranks' spinning OpenMP threads
        torch.set_num_threads(num_threads or max(1, usable_cpus() // pc.world_size))
    init_distributed(rank, pc.tensor_parallel_size, pc.pipeline_parallel_size, init_method,
                     "nccl" if config.device == "cuda" else "gloo", collective_timeout_s(), pc.enable_expert_parallel)
    # The head resolved the model to a directory on its own disk (a GGUF file becomes a cache folder there).
    # Resolve it again from the user's argument, so another node converts / finds its own copy.
    mc = config.model
    mc.model_dir = resolve_model_path(mc.model, gguf_weights=gguf_weights_for(mc.gguf_weights, mc.quantization))
    spec = config.speculative
    if spec is not None and spec.draft_model_dir:
        spec.draft_model_dir = resolve_model_path(spec.model, gguf_weights=gguf_weights_for("auto", spec.quantization))


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, step_interrupt: Optional[StepInterrupt] = None) -> None:
        """step_interrupt: the engine's, where it runs this worker in its own process (step/interrupt.py)."""
        self.config = config
        self.rank = rank
        mc = config.model
        torch.manual_seed(mc.seed)
        self.device = config.device
        batch_invariant.enable(config.batch_invariant)
        if config.batch_invariant and not (cpu_linear.available() and cpu_kernels.load() is not None):
            raise RuntimeError("--batch-invariant needs tokenmill's C kernels, which could not be built here "
                               "(is a C compiler installed? see the warning above)")
        # This rank's start-up phases (the engine merges the output rank's into the server's ledger).
        self.ledger = Ledger(f"rank{rank}", origin=0.0)
        if self.device == "cpu":
            with self.ledger.phase("kernels"):  # build (cold) or load (warm) every C library up front
                kernels_report.load_all_libraries()
        self.backend = get_attention_backend(self.device)
        if mc.quantize_lm_head and mc.online_quantization is None:
            logger.warning("--quantize-lm-head has no effect on this model: it applies to --quantization on a "
                           "float checkpoint (%s)", f"the checkpoint's own {mc.quantization} quantization_config "
                           "decides which layers are quantized" if mc.quantization else "none given")
        self.model = load_model(mc.model_dir, mc.hf_config, mc.torch_dtype, self.device, self.backend,
                                max_positions=mc.max_model_len, quantization=mc.online_quantization,
                                quantize_lm_head=mc.quantize_lm_head,
                                layer_range=stage_layers(mc.hf_config.num_hidden_layers,
                                                         config.parallel.layers_per_stage(mc.hf_config.num_hidden_layers)),
                                ledger=self.ledger)
        self.drafter = None
        if config.speculative is not None:
            self.drafter = make_proposer(config, self.model, self.backend)
        self.kv_layout = kv_layout(config)  # the scheduler computes the same
        lora = LoRAManager(self.model, config.lora, mc.torch_dtype, self.device) if config.lora is not None else None
        self.runner = ModelRunner(self.model, self.device, config.cache.block_size, mc.hf_config.vocab_size,
                                  mc.seed, self.drafter, mc.max_model_len, mc.pooler, self.kv_layout, lora,
                                  step_interrupt)
        self.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, mc.torch_dtype)
        self.kv_connector = None
        self.kernels: dict = {}  # kernels_report.report, once the KV cache exists
        self.thread_sizer = ThreadSizer() if self.device == "cpu" else None
        if self.kv_dtype.itemsize == 1:  # fp8/int8 cache: each attention layer quantizes on write
            for module in self.model.modules():
                if hasattr(module, "kv_quant"):
                    module.kv_quant = KVCacheQuant(self.kv_dtype, module.num_kv_heads).to(self.device)
                    for which, value in module.checkpoint_kv_scales.items():
                        module.kv_quant.load_scale(which, value)

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer slot's KV tensor, as the model's attention lays it out (K/V heads, or an MLA latent)."""
        return self.model.layers[0].self_attn.kv_cache_shape(num_blocks, self.config.cache.block_size)

    def _layer_slots(self) -> list[int]:
        """Per layer of this rank's model (a pipeline stage holds only its own), its KV layer slot: the layers of
        different KV groups in the same slot share one tensor (step/kv_groups.py)."""
        start = getattr(self.model, "start_layer", 0)
        return [self.kv_layout.layer_slot[start + i] for i in range(len(self.model.layers))]

    def bytes_per_block(self) -> int:
        shape = self.kv_shape(1)
        per_slot = torch.Size(shape).numel() * self.kv_dtype.itemsize
        return per_slot * len(set(self._layer_slots())) + (self.drafter.bytes_per_block() if self.drafter else 0)

    def determine_num_blocks(self) -> int:
        cc = self.config.cache
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            budget = total * cc.gpu_memory_utilization - (total - free)
            budget -= 2 * 2**30 if cc.kv_cache_memory_bytes is None else 0  # activation headroom
            if cc.kv_cache_memory_bytes is not None:
                budget = cc.kv_cache_memory_bytes
        else:
            budget = cc.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        num = int(budget // self.bytes_per_block())
        if num < 1:
            raise ValueError(f"KV cache budget of {budget / 2**30:.2f} GiB holds no block "
                             f"({self.bytes_per_block()} bytes each); raise --kv-cache-memory-bytes")
        return num

    def initialize_cache(self, num_blocks: int) -> None:
        shape = self.kv_shape(num_blocks)
        if not getattr(self.model, "uses_kv_cache", True):  # an encoder: the scheduler's blocks are bookkeeping
            shape = (0,)
        # Never-written slots are read (masked) by attention, so they must hold finite values: zeros, touched
        # only as blocks fill where the pool is large (zeroed_tensors)
        layer_slots = self._layer_slots()
        slot_ids = sorted(set(layer_slots))
        slots = dict(zip(slot_ids, zeroed_tensors([shape] * len(slot_ids), self.kv_dtype, self.device)))
        self.runner.kv_caches = [slots[slot] for slot in layer_slots]
        if self.drafter is not None:
            self.drafter.initialize_cache(num_blocks)
        self.kernels = kernels_report.report(self.model, self.runner.kv_caches, self.device, self.kv_layout)
        kernels_report.announce(self.kernels)  # raises under TOKENMILL_REQUIRE_KERNELS=1 on any fallback
        self.kv_connector = make_worker_connector(self.config, self.bytes_per_block())
        if self.kv_connector is not None:  # a block moves with its draft KV too: the drafter's cache shares ids
            quants = [getattr(getattr(layer, "self_attn", None), "kv_quant", None) for layer in self.model.layers]
            self.kv_connector.register_kv_caches(self.runner.kv_caches + list(getattr(self.drafter, "kv_caches", [])),
                                                 quants)
        release_free_heap()  # the end of the start: the load's and the kernel probes' freed buffers

    def execute_model(self, scheduler_output):
        connector, plan = self.kv_connector, scheduler_output.kv_connector_plan
        if self.thread_sizer is not None:
            self.thread_sizer.update()
        if plan is not None:
            connector.start_step(plan)  # blocks this step reads are in place before the forward pass
        out = self.runner.execute(scheduler_output)
        if plan is not None:
            connector.after_step(plan)  # what this step's forward pass wrote may be sent on
        if connector is not None:
            out.kv_connector_output = connector.finished(wait=not scheduler_output.scheduled)
        return out

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.close()

"""The model runner: loads the model, owns the paged KV cache, runs one step and samples.

On CUDA it profiles memory at the full batch, sizes the KV cache from what is left (CUDA graphs counted)
and captures decode steps as CUDA graphs. With tensor_parallel_size N, rank 0 (this object in the
engine's process) spawns N-1 workers and broadcasts each step's plain inputs to them; only rank 0 samples.
"""

import atexit
import contextlib
import dataclasses
import logging
import time

import torch

from services.engine.config import EngineArgs
from services.engine.core.interfaces import SchedulerOutput
from services.engine.core.sampling_params import SamplingParams
from services.common.default_model import resolve_model_path
from services.engine.distributed import parallel_state as tp
from services.engine.distributed.sharding import check_tensor_parallel
from services.engine.layers.attention_backends.select import get_backend, supports_cuda_graphs
from services.engine.layers.quantization import quantize_model
from services.engine.loader import gguf_file_of, load_model_config, load_weights, open_gguf
from services.engine.models.registry import get_model_class
from services.engine.runner.grammar import GrammarMasks
from services.engine.runner.grammar_compiler import GrammarCompiler
from services.engine.runner.cuda_graphs import DecodeGraphBuffers, DecodeGraphs, graph_batch_sizes
from services.engine.runner.inputs import StepInputBuilder, StepInputs, cacheless_prefill, to_model_inputs
from services.engine.runner.prompt_logprobs import compute_prompt_logprobs
from services.engine.runner.quantization_choice import resolve_quantization
from services.engine.runner.kv_cache import allocate_kv_cache, bind_kv_cache, size_kv_cache, unbound_kv_cache
from services.engine.runner.sampling_step import StepSampler

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_device(name: str, rank: int = 0, tp_size: int = 1) -> torch.device:
    """"auto": cuda when available, else cpu. Tensor-parallel rank r on CUDA uses cuda:r."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else torch.device(name)
    if tp_size > 1 and device.type == "cuda":
        if torch.cuda.device_count() < tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} needs {tp_size} GPUs; {torch.cuda.device_count()} found")
        return torch.device("cuda", rank)
    return device


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: the CPUs whose bf16 matmuls beat fp32 (on AMX 2.6-6x at batch 32-256). Elsewhere
    (AVX2 only) torch emulates bf16 and loses 2-10x at batch >= 8, so auto stays fp32 there."""
    capabilities = torch.cpu.get_capabilities()
    return bool(capabilities.get("amx_bf16") or capabilities.get("avx512_bf16"))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bf16 on CUDA (fp16 where bf16 is unsupported); on CPU bf16 where `cpu_has_fast_bf16`, else
    fp32. Norms, softmax, log-probabilities and sampling compute in fp32 whatever the weights' dtype."""
    if name == "auto":
        if device.type != "cuda":
            return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class SampledIds:
    """Brings a step's sampled ids [S] to the host: on CUDA through a reusable pinned buffer, a non-blocking
    copy and an event, so the host waits for exactly that copy (the one sync of a step) and nothing else."""

    def __init__(self, max_num_seqs: int, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.host = torch.empty(max(1, max_num_seqs), dtype=torch.int64, pin_memory=True)
            self.event = torch.cuda.Event()

    def to_host(self, token_ids: torch.Tensor) -> list[int]:
        if self.device.type != "cuda":
            return token_ids.tolist()
        if token_ids.numel() > self.host.numel():
            self.host = torch.empty(token_ids.numel(), dtype=torch.int64, pin_memory=True)
        host = self.host[:token_ids.numel()]
        host.copy_(token_ids, non_blocking=True)
        self.event.record()
        self.event.synchronize()
        return host.tolist()


class ModelRunner:
    """core.interfaces.ModelRunner over a real model: `execute(batch)` -> one sampled id (or None) per sequence.

    Exposes what the engine core needs to be built: num_kvcache_blocks, max_model_len, vocab_size,
    eos_token_ids (from the checkpoint's config / generation config; the tokenizer's are added by the caller).
    """

    def __init__(self, args: EngineArgs, share_model_with: "ModelRunner | None" = None, rank: int = 0):
        """Load the model named by args, or reuse the already loaded model of `share_model_with` (same
        checkpoint, device and dtype) with a KV cache of this runner's own. `rank` > 0 only in workers."""
        self.args = args
        self.rank = rank
        self.tp_size = args.tensor_parallel_size
        self._workers: list = []
        if self.tp_size > 1 and share_model_with is not None:
            raise ValueError("sharing a loaded model (with_scheduler) is not supported with tensor parallelism")
        if share_model_with is None:
            self.device = resolve_device(args.device, rank, self.tp_size)
            self._read_config(args)  # a model that cannot be split fails here, before any process starts
            if self.tp_size > 1:
                self._join_tensor_parallel_group()
        try:
            if share_model_with is None:
                self._build_model()
            else:
                self._share_model(share_model_with)
            self._set_up_cache(use_graphs=self._wants_cuda_graphs(share_model_with))
        except BaseException:
            self._abandon_workers()
            raise
        logger.info("model %s (%s) on %s/%s, quantization %s, attention %s, %d KV blocks of %d tokens, "
                    "CUDA graphs %s%s",
                    self.model_path, self.model_config.architecture, self.device, self.dtype, self.quantization,
                    self.attention_backend.name, self.num_kvcache_blocks, self.block_size,
                    "on" if self.graphs else "off", f", TP rank {rank} of {self.tp_size}" if self.tp_size > 1 else "")

    def _join_tensor_parallel_group(self) -> None:
        store, port = None, self.args.distributed_port
        if self.rank == 0:
            from services.engine.distributed.worker import launch_workers

            store = tp.open_rendezvous(port)  # port 0: a free one, bound from here on
            port = store.port
            self._workers = launch_workers(run_worker, dataclasses.replace(self.args, distributed_port=port),
                                           self.tp_size)
            atexit.register(self.shutdown)
        try:
            tp.init_tensor_parallel(self.rank, self.tp_size, self.device, port, store=store)
        except BaseException:
            self._abandon_workers()
            raise

    def _abandon_workers(self) -> None:
        """After a failure on rank 0: terminate the workers (they may be blocked in a collective)."""
        from services.engine.distributed.worker import stop_workers

        workers, self._workers = self._workers, []
        for process in workers:
            process.terminate()
        stop_workers(workers)
        if self.rank == 0 and self.tp_size > 1:
            tp.destroy_tensor_parallel()

    def _read_config(self, args: EngineArgs) -> None:
        self.model_path = resolve_model_path(args.model)
        self.quantization = resolve_quantization(args.quantization, self.device, self.tp_size,
                                                 is_gguf=gguf_file_of(self.model_path) is not None)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.block_size = args.kvcache_block_size
        self.model_config = load_model_config(self.model_path)
        config = self.model_config
        check_tensor_parallel(config.num_attention_heads, config.num_key_value_heads, config.intermediate_size,
                              self.tp_size)
        self.max_model_len = self._resolve_max_model_len(args.max_model_len)
        self.vocab_size = config.vocab_size
        self.eos_token_ids = list(config.eos_token_ids)
        self.attention_backend = get_backend(args.attention_backend, self.device, self.block_size)

    def _build_model(self) -> None:
        model_class = get_model_class(self.model_config)
        with _default_dtype(self.dtype), self.device, tp.tensor_parallel_layout(self.rank, self.tp_size):
            self.model = model_class(self.model_config, max_positions=self.max_model_len,
                                     backend=self.attention_backend)
        load_weights(self.model, self.model_path)
        q4_parts = None
        if self.quantization == "gguf":
            from services.engine.loader.gguf_int4 import gguf_q4_1_projections

            q4_parts = gguf_q4_1_projections(open_gguf(gguf_file_of(self.model_path)), self.model_config)
        quantize_model(self.model, self.quantization, q4_parts)
        self.model.eval()

    def _set_up_cache(self, use_graphs: bool) -> None:
        """Size (every rank agreeing), allocate and bind the KV cache, then capture the decode graphs."""
        self.sampler = StepSampler(self.args.seed, self.vocab_size, self.device)
        self.grammar_masks = GrammarMasks(GrammarCompiler(None, self.vocab_size, []), self.device)
        self._device_logprobs = None
        self._logprobs: dict = {}
        self._device_prompt_logprobs = None
        self._prompt_logprobs: dict = {}
        self.inputs = StepInputBuilder(self.block_size, self.max_blocks_per_seq, self.args.max_num_seqs, self.device)
        self._sampled = SampledIds(self.args.max_num_seqs, self.device)
        self.graphs: DecodeGraphs | None = None
        self._attention_layers = self.model.attention_layers()
        self.num_kvcache_blocks = size_kv_cache(self, use_graphs)
        if self.tp_size > 1:
            self.num_kvcache_blocks = tp.all_reduce_min(self.num_kvcache_blocks)
        layer = self._attention_layers[0]
        self.kv_cache = allocate_kv_cache(
            len(self._attention_layers), self.num_kvcache_blocks, self.block_size, layer.num_kv_heads,
            layer.head_dim, self.dtype, self.device)  # [L, 2, num_blocks, block_size, Hkv, D]
        bind_kv_cache(self._attention_layers, self.kv_cache)
        if use_graphs:
            self.graphs = self._capture_cuda_graphs()

    def _share_model(self, other: "ModelRunner") -> None:
        for name in ("device", "dtype", "quantization", "block_size", "model_path", "model_config", "max_model_len",
                     "vocab_size", "eos_token_ids", "attention_backend", "model"):
            setattr(self, name, getattr(other, name))

    def _resolve_max_model_len(self, requested: int | None) -> int:
        model_max = self.model_config.max_position_embeddings
        if requested is None:
            return min(model_max, DEFAULT_MAX_MODEL_LEN)
        if not 0 < requested <= model_max:
            raise ValueError(f"max_model_len {requested} must be in [1, {model_max}] for this model")
        return requested

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def _wants_cuda_graphs(self, share_model_with: "ModelRunner | None") -> bool:
        if self.device.type != "cuda" or self.args.enforce_eager or share_model_with is not None:
            return False
        if not supports_cuda_graphs(self.attention_backend):
            logger.info("CUDA graphs off: the %s attention backend is not graph-safe", self.attention_backend.name)
            return False
        return True

    @torch.inference_mode()
    def _capture_cuda_graphs(self) -> DecodeGraphs:
        started = time.perf_counter()
        sizes = graph_batch_sizes(self.args.max_num_seqs)
        buffers = DecodeGraphBuffers(sizes[-1], self.max_blocks_per_seq, self.block_size, self.device)
        graphs = DecodeGraphs(self.model, buffers, sizes)
        graphs.capture()
        torch.cuda.empty_cache()
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1fs", len(sizes), sizes[0], sizes[-1],
                    time.perf_counter() - started)
        return graphs

    def enable_structured_output(self, tokenizer, stop_token_ids: list[int]) -> None:
        """Let requests constrain their output (JSON schema, regex, grammar), compiled against `tokenizer`."""
        self.grammar_masks = GrammarMasks(GrammarCompiler(tokenizer, self.vocab_size, stop_token_ids), self.device)

    def compile_grammar(self, sampling: SamplingParams) -> None:
        """Compile (or find cached) a constrained request's grammar at admission (see core.interfaces)."""
        self.grammar_masks.compiler.compile(sampling.constraint)

    def compute_logits(self, step: StepInputs) -> torch.Tensor | None:
        """Run the model on one step (graph replay for a decode batch that fits a captured size) and return
        the logits [S, V] of its sampled rows, or None when none is sampled. Every rank runs this."""
        hidden = self.graphs.run(step) if self.graphs is not None and not step.is_prefill else None
        if hidden is None:
            inputs = to_model_inputs(step, self.device)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)  # [N, hidden]
            if step.prompt_rows is not None:  # rows of the prompt positions a request asked logprobs for
                self._device_prompt_logprobs = compute_prompt_logprobs(
                    self.model.compute_logits, hidden, step.prompt_rows, max(1, self.args.max_num_seqs))
            if step.is_prefill:
                if not step.sample_seq_indices:
                    return None
                hidden = hidden.index_select(0, inputs.logits_indices)  # [S, hidden]
        return self.model.compute_logits(hidden)  # [S, V]

    @torch.inference_mode()
    def logits(self, batch: SchedulerOutput) -> tuple[torch.Tensor | None, list[int]]:
        """The step's logits [S, V] (None if nothing is sampled) and the batch position of each row; the prompt
        log-probabilities a request asked for wait in `self._device_prompt_logprobs` for `execute`."""
        self._device_prompt_logprobs = None
        if self._attention_layers[0].k_cache.data_ptr() != self.kv_cache.data_ptr():
            bind_kv_cache(self._attention_layers, self.kv_cache)  # another runner shares this model
        step = self.inputs.build(batch)
        if self.tp_size > 1:
            tp.broadcast_object(step.detached())
        logits = self.compute_logits(step)
        self.inputs.inputs_enqueued()
        return logits, step.sample_seq_indices

    @torch.inference_mode()
    def sample_on_device(self, batch: SchedulerOutput) -> tuple[torch.Tensor | None, list[int]]:
        """Run the step and sample, leaving the token ids [S] on the device: nothing here waits on it.
        Log-probabilities, when a sequence asked for them, wait in `self._device_logprobs` for `execute`."""
        logits, sample_seq_indices = self.logits(batch)
        self._device_logprobs = None
        if logits is None:
            return None, sample_seq_indices
        sampled_seqs = [batch.seqs[i] for i in sample_seq_indices]
        token_ids, self._device_logprobs = self.sampler.sample(logits, sampled_seqs, self.eos_token_ids,
                                                                self.grammar_masks)
        return token_ids, sample_seq_indices

    def take_prompt_logprobs(self) -> dict:
        """seq_id -> PromptLogprobs chunk of the last execute, for the sequences that need them (interfaces)."""
        chunks, self._prompt_logprobs = self._prompt_logprobs, {}
        return chunks

    def take_logprobs(self) -> dict:
        """seq_id -> TokenLogprobs of the last execute, for the sequences that asked (see interfaces.ModelRunner)."""
        logprobs, self._logprobs = self._logprobs, {}
        return logprobs

    def execute(self, batch: SchedulerOutput) -> list[int | None]:
        """Compute the batch's tokens, then sample for each sequence whose whole token list is computed.
        The one host-device sync of a step is reading the sampled ids."""
        results: list[int | None] = [None] * len(batch.seqs)
        if not batch.seqs:
            return results
        token_ids, sample_seq_indices = self.sample_on_device(batch)
        sampled = self._sampled.to_host(token_ids) if token_ids is not None else None
        self._prompt_logprobs = {}
        if self._device_prompt_logprobs is not None:  # a step of chunks only waits on the device here
            self._prompt_logprobs = self._device_prompt_logprobs.to_host()
            self._device_prompt_logprobs = None
        if sampled is None:
            return results
        if self._device_logprobs is not None:
            self._logprobs = self._device_logprobs.to_host()  # after the step's sync: the values are ready
        if len(sampled) == len(results):  # every sequence sampled (always so in decode), in batch order
            return sampled
        for i, token_id in zip(sample_seq_indices, sampled):
            results[i] = token_id
        return results

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [n, V] at every position of one sequence, computed without the KV cache (checks)."""
        if self.tp_size > 1:
            raise NotImplementedError("score() runs on a single rank only")
        step = cacheless_prefill([token_ids])
        step.logits_indices = torch.arange(len(token_ids))
        step.sample_seq_indices = list(range(len(token_ids)))
        with unbound_kv_cache(self._attention_layers):
            return self.compute_logits(step).float()

    def serve_as_worker(self) -> None:
        """Worker ranks: run every step rank 0 broadcasts until it broadcasts None."""
        with torch.inference_mode():
            while (step := tp.broadcast_object(None)) is not None:
                self.compute_logits(step)

    def shutdown(self) -> None:
        """Rank 0: stop the tensor-parallel workers and leave the group (idempotent; no-op at TP 1)."""
        if self.rank != 0 or not self._workers:
            return
        from services.engine.distributed.worker import stop_workers

        workers, self._workers = self._workers, []
        try:
            tp.broadcast_object(None)
        finally:
            stop_workers(workers)
            tp.destroy_tensor_parallel()


def run_worker(args: EngineArgs, rank: int) -> None:
    """Entry of a tensor-parallel worker process (rank > 0), started by distributed.worker.launch_workers."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    try:
        ModelRunner(args, rank=rank).serve_as_worker()
    finally:
        tp.destroy_tensor_parallel()

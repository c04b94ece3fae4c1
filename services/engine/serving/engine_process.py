"""The engine core in a child process, behind EngineCore's interface.

The engine thread of the service would otherwise share one interpreter lock with the gRPC event loop:
every torch op hands the lock back and forth, and a busy loop delays each hand-back. Here the model
steps in its own process; the parent's engine thread only sends commands and receives each step's
outputs over a pipe (plain dataclasses, pickled). Requests are validated in the parent against a
model-less copy of the core, so bad input is refused before it reaches the pipe.
"""

import logging
import multiprocessing as mp
import signal
from dataclasses import dataclass

from services.common.default_model import model_display_name
from services.engine.core.engine import EngineCore
from services.engine.core.interfaces import EngineStats, RequestOutput
from services.engine.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineDescription:
    """What GetEngineInfo reports, computed where the model is loaded."""

    fields: dict
    scheduler_config: object
    eos_token_ids: list[int]
    vocab_size: int
    stats: EngineStats


def describe(llm) -> EngineDescription:
    """The description of a loaded offline engine (services.engine.llm.LLM)."""
    from services.common.fingerprint import tokenizer_fingerprint

    runner, config = llm.runner, llm.engine.config
    fields = dict(
        model_name=model_display_name(runner.model_path), vocab_size=runner.vocab_size, max_model_len=config.max_model_len,
        eos_token_ids=list(llm.eos_token_ids),
        tokenizer_fingerprint=tokenizer_fingerprint(llm.tokenizer) if llm.tokenizer is not None else "",
        block_size=config.block_size, num_total_blocks=config.num_kvcache_blocks, device=str(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."), architecture=runner.model_config.architecture,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching, tensor_parallel_size=llm.args.tensor_parallel_size)
    return EngineDescription(fields, config, list(llm.eos_token_ids), runner.vocab_size, llm.engine.stats())


class EngineProcess:
    """EngineCore's interface (add/abort/step/stats/validate) over an EngineCore living in a child process."""

    def __init__(self, engine_kwargs: dict):
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_child_main, args=(child_conn, engine_kwargs),
                                        name="llmserve-engine-core", daemon=True)
        self._process.start()
        child_conn.close()
        self.description: EngineDescription = self._reply()
        self._validator = EngineCore(self.description.scheduler_config, runner=None,
                                     eos_token_ids=self.description.eos_token_ids,
                                     vocab_size=self.description.vocab_size)
        self.config = self.description.scheduler_config
        self._stats = self.description.stats
        self._has_unfinished = False

    def validate_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        self._validator.validate_request(prompt_token_ids, sampling)

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    arrival_time: float | None = None) -> None:
        self._call("add", request_id, prompt_token_ids, sampling, arrival_time)

    def abort_request(self, request_id: str) -> bool:
        return self._call("abort", request_id)

    def step(self) -> list[RequestOutput]:
        return self._call("step")

    def has_unfinished_requests(self) -> bool:
        return self._has_unfinished

    def stats(self) -> EngineStats:
        return self._stats

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()

    def _call(self, *command):
        self._conn.send(command)
        return self._reply()

    def _reply(self):
        try:
            kind, value, stats, has_unfinished = self._conn.recv()
        except EOFError:
            raise RuntimeError("the engine core process died") from None
        if stats is not None:
            self._stats, self._has_unfinished = stats, has_unfinished
        if kind == "error":
            raise value
        return value


def _child_main(conn, engine_kwargs: dict) -> None:
    """Load the model, describe it, then serve commands until told to stop or the parent goes away."""
    from services.engine.llm import LLM

    # NOTE: Ctrl-C reaches the whole process group; the parent drains and then says "stop".
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    try:
        llm = LLM(**engine_kwargs)
        core = llm.engine
        conn.send(("ok", describe(llm), core.stats(), False))
    except BaseException as exc:  # noqa: BLE001 - the parent re-raises it
        conn.send(("error", RuntimeError(f"engine failed to start: {exc!r}"), None, False))
        return
    handlers = {"add": core.add_request, "abort": core.abort_request, "step": core.step}
    while True:
        try:
            command = conn.recv()
        except EOFError:
            return
        if command[0] == "stop":
            return
        try:
            result = ("ok", handlers[command[0]](*command[1:]))
        except Exception as exc:  # noqa: BLE001 - typed engine errors go back to the caller
            result = ("error", exc)
        conn.send((*result, core.stats(), core.has_unfinished_requests()))

"""Every service process freezes its start-up heap out of the cyclic garbage collector's reach.

A service process imports torch, transformers and grpc, and loads a tokenizer or a model: some 360k objects
that live as long as the process. In the collector's oldest generation, each full collection walks all of them
(255 ms in the tokenizer service on a 2-core CPU machine), stalling every stream that process serves; and at
serving rates the objects each request leaves behind trigger one every few seconds (11 in a 40 s load of
bench/tokenizer_relay.py, 2.5 s of the tokenizer service's 18 s of CPU, the longest 353 ms). Moved to the
permanent generation once start-up is over (as vLLM does once its engine has started), they are never scanned
again: a full collection then walks only what was created since.

No grpc or torch here: the engine-core process calls this too.
"""

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Free start-up garbage, then move every object left to the permanent generation; returns their number.

    The collection comes first so that no garbage cycle (a model-loading temporary holding a tensor) is frozen
    with the rest, where it could never be freed.
    """
    gc.collect()
    gc.freeze()
    num_frozen = gc.get_freeze_count()
    logger.info("start-up heap frozen: %d objects out of the garbage collector's scans", num_frozen)
    return num_frozen

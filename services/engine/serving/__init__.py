"""The engine service's serving side: the gRPC adapter, the bridge to the engine-core process, CLI wiring.

Everything the engine itself is (core, runner, models, layers, kernels, loader) lives beside this folder
and knows nothing of gRPC; this folder knows the engine only through EngineCore's interface.
"""

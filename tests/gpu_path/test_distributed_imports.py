"""services/engine/distributed sits below the model code: layers and the runner import it, never the reverse
(the runner <-> worker import circle is gone: the runner hands launch_workers its worker entry)."""

from tests.test_import_rules import SERVICES, python_files, violations

ABOVE_DISTRIBUTED = ("services.engine.runner", "services.engine.models", "services.engine.layers",
                     "services.engine.serving")


def test_distributed_imports_nothing_from_the_runner_or_the_model_code():
    assert violations(python_files(SERVICES / "engine" / "distributed"), ABOVE_DISTRIBUTED) == []

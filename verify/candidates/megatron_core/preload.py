"""Imported by the rank launcher's fork server where a run includes Megatron-Core.

Megatron's import costs each rank about 3 s of CPU. The fork server imports it once, before
any configuration exists, and every rank process is forked from it: each configuration still
starts in a fresh process, with nothing but import-time state. Without megatron-core
installed this imports nothing. Megatron's import-time notices (its fallback to torch's
optimizers, which the candidate's feature table records) are not printed from the server.
"""

import importlib.util
import warnings

if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.distributed  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel.schedules  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401
        import megatron.core.transformer.transformer_config  # noqa: F401

"""Run model-written Python under stated limits (docs/sandbox.md says what each backend does).

    from turnrl.sandbox import Sandbox, Limits
    result = Sandbox(limits=Limits(wall_s=2)).run_sync("print(6 * 7)")
    result.status, result.stdout          # ("ok", "42\\n")
"""

from turnrl.sandbox.backends import GUARANTEES
from turnrl.sandbox.core import STATUSES, Limits, Sandbox, SandboxResult

__all__ = ["GUARANTEES", "STATUSES", "Limits", "Sandbox", "SandboxResult"]

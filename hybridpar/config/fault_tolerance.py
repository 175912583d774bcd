"""The [fault_tolerance] config section, without torch: replica groups that drop out of a step and
rejoin while the others train on, through torchft (hybridpar.replicas applies it; torchft is imported
only when it is enabled).

    enabled     each replica group is its own launcher world (mp x dp_shard x cp x pp inside);
                the groups replicate the model and average their gradients every step
    group       this group's index, 0 .. groups - 1
    groups      how many groups the job has (each reads its own share of the data)
    lighthouse  the torchft lighthouse's address ("": the TORCHFT_LIGHTHOUSE variable)
    min_groups  the fewest groups that may commit a step
    timeout     seconds a step waits for a silent group before the others go on without it
    record_windows  debug: each group's windows.jsonl, the windows every step read and who committed it
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

from .options import ConfigError, option

INSTALL = "pip install 'hybridpar[ft]' (or pip install torchft)"
LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"  # torchft's own name for the address


@dataclasses.dataclass
class FaultToleranceConfig:
    enabled: bool = option(False, "replica groups (torchft): a group that fails drops out of the step, the others "
                                  "commit it, and it rejoins healed from a live group")
    group: int = option(0, "this replica group's index (0 .. fault_tolerance.groups - 1)")
    groups: int = option(1, "replica groups in the job, each its own launcher world reading its own share of the data")
    lighthouse: str = option("", "the torchft lighthouse's address, e.g. http://node0:29510 (\"\": the "
                                 "TORCHFT_LIGHTHOUSE variable); `hybridpar lighthouse` starts one")
    min_groups: int = option(1, "the fewest groups that may commit a step")
    timeout: float = option(30.0, "seconds a step waits for a silent group (and the quorum for a joining one) "
                                  "before the others go on without it")
    record_windows: bool = option(False, "debug: each group writes windows.jsonl in its run folder: the (source, "
                                         "window) pairs each step read and the groups that committed each step")

    def validate(self) -> None:
        """ConfigError naming the fault_tolerance.* key (what needs no process group and no torchft)."""
        if not self.enabled:
            return
        if self.groups < 1:
            raise ConfigError(f"fault_tolerance.groups must be >= 1, got {self.groups}")
        if not 0 <= self.group < self.groups:
            raise ConfigError(f"fault_tolerance.group must be in 0 .. {self.groups - 1} (fault_tolerance.groups = "
                              f"{self.groups}), got {self.group}")
        if not 1 <= self.min_groups <= self.groups:
            raise ConfigError(f"fault_tolerance.min_groups must be in 1 .. {self.groups} (fault_tolerance.groups), "
                              f"got {self.min_groups}")
        if not self.timeout > 0:
            raise ConfigError(f"fault_tolerance.timeout must be > 0 seconds, got {self.timeout}")

    def address(self, environ=os.environ) -> str:
        """The lighthouse's address: fault_tolerance.lighthouse, else TORCHFT_LIGHTHOUSE; ConfigError if neither."""
        found = self.lighthouse or environ.get(LIGHTHOUSE_VARIABLE, "")
        if not found:
            raise ConfigError(f"fault_tolerance.enabled needs the lighthouse's address: set fault_tolerance.lighthouse "
                              f"(e.g. http://node0:29510) or {LIGHTHOUSE_VARIABLE}; `hybridpar lighthouse` starts one")
        return found

    def group_run_dir(self, run_dir: str) -> str:
        """Where this group's logs go: each group writes its own metrics, events and summary."""
        return str(Path(run_dir) / f"group-{self.group}")


def require_torchft() -> None:
    """ConfigError in one line, saying what to install, when torchft is not importable."""
    try:
        found = importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        found = False
    if not found:
        raise ConfigError(f"fault_tolerance.enabled needs torchft, which is not installed: {INSTALL}")

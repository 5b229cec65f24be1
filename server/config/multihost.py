"""The ``[multihost]`` section: a group of processes serving one model."""
from __future__ import annotations

import dataclasses

from expertd.server.config.fields import (
    DEFAULT_COORDINATOR_PORT,
    option,
    optional_str,
)


@dataclasses.dataclass(frozen=True)
class MultihostConfig:
    """This process's place in a multi-host group (expertd.server.multihost.serve); one process unless
    ``num_processes`` > 1. The LeaderWorkerSet variables fill what no flag or TOML key sets."""

    coordinator_address: str | None = option(None, "jax.distributed coordinator HOST:PORT, on process 0 (default: "
                                             "$LWS_LEADER_ADDRESS:--coordinator-port)", parse=optional_str,
                                             metavar="HOST:PORT")
    coordinator_port: int = option(DEFAULT_COORDINATOR_PORT, "coordinator port with $LWS_LEADER_ADDRESS", parse=int,
                                   metavar="PORT")
    num_processes: int = option(1, "processes in the group (default: $LWS_GROUP_SIZE, else 1)", parse=int,
                                metavar="N", env="LWS_GROUP_SIZE")
    process_id: int = option(0, "this process's index; 0 runs the gRPC front end (default: $LWS_WORKER_INDEX)",
                             parse=int, metavar="I", env="LWS_WORKER_INDEX")
    multihost_port: int | None = option(None, "process 0's batch channel to the others (default: coordinator "
                                        "port + 1)", parse=int, metavar="PORT")
    peer_timeout_s: float = option(10.0, "a peer silent this long is lost", parse=float, metavar="SECONDS")
    exit_grace_s: float = option(2.0, "NOT_SERVING this long before exiting on a lost peer", parse=float,
                                 metavar="SECONDS")
    join_timeout_s: float = option(600.0, "wait this long for the group to form", parse=float, metavar="SECONDS")

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(f"--num-processes ($LWS_GROUP_SIZE) must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id ($LWS_WORKER_INDEX) must be between 0 and {self.num_processes - 1}, "
                             f"got {self.process_id}")
        if self.enabled and not self.coordinator_address:
            raise ValueError("a group of several processes needs --coordinator-address HOST:PORT "
                             "(or LWS_LEADER_ADDRESS)")
        if self.enabled:
            self.coordinator_host  # noqa: B018 - validates HOST:PORT
        for name in ("peer_timeout_s", "exit_grace_s", "join_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def coordinator_host(self) -> str:
        host, sep, port = self.coordinator_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--coordinator-address must be HOST:PORT, got {self.coordinator_address!r}")
        return host.strip("[]")

    @property
    def channel_port(self) -> int:
        """The leader's batch-channel port (default: the coordinator's port + 1)."""
        if self.multihost_port is not None:
            return self.multihost_port
        return int(self.coordinator_address.rpartition(":")[2]) + 1

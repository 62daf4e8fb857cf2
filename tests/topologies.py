"""Private multi-server set-ups for tests: a three-master Redis Cluster, a Sentinel-managed pair.

Every server is a :class:`~celery_lockguard.testing.RedisServer` on a free
loopback port, from the same binary the rest of the suite uses, so the Valkey
compatibility run (``make compat``) exercises them too. Nothing here touches
the shared Redis.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from celery_lockguard import testing
from celery_lockguard.testing import RedisServer, free_port, server_binary

from .harness import wait_for

#: Connection set-up of any client (the measuring ones included), not a command of the code measured.
_HANDSHAKE = {"HELLO", "CLIENT", "ECHO", "AUTH", "SELECT", "READONLY"}


class LocalCluster(testing.LocalCluster):
    """The library's :class:`~celery_lockguard.testing.LocalCluster`, with what the Cluster tests count on it."""

    def commands(self) -> dict[str, int]:
        """Calls per command summed over every master since the last :meth:`reset_stats`."""
        out: dict[str, int] = {}
        for c in self.node_clients():
            for name, stats in c.info("commandstats").items():
                cmd = name.removeprefix("cmdstat_")
                out[cmd] = out.get(cmd, 0) + int(stats["calls"])
        return out

    def top_level_commands(self, fn: Callable[[], Any]) -> tuple[Any, list[tuple[int, str]]]:
        """Run ``fn`` and return its result and the commands clients sent the masters meanwhile.

        Read with MONITOR on every master, in server time order, leaving out
        what scripts call (``lua``) and connection handshakes: each entry is
        one command a client sent, i.e. one round trip unless pipelined.
        """
        marker = f"lockguard-monitor-{uuid.uuid4().hex}"
        seen: list[list[tuple[float, str]]] = [[] for _ in self.nodes]
        monitors = [n.client().monitor() for n in self.nodes]
        threads = []
        for i, m in enumerate(monitors):
            m.__enter__()

            def read(i: int = i, m: Any = m) -> None:
                while True:
                    cmd = m.next_command()
                    if marker in cmd["command"]:
                        return
                    verb = cmd["command"].split(" ", 1)[0].upper()
                    if cmd.get("client_type") != "lua" and verb not in _HANDSHAKE:
                        seen[i].append((float(cmd["time"]), cmd["command"]))

            t = threading.Thread(target=read, daemon=True)
            t.start()
            threads.append(t)
        try:
            result = fn()
        finally:
            for c in self.node_clients():
                c.echo(marker)
            for t in threads:
                t.join(10)
            for m in monitors:
                m.__exit__()
        timed = sorted((t, i, c) for i, cmds in enumerate(seen) for t, c in cmds)
        return result, [(i, c) for _, i, c in timed]

    def per_node(self, command: str) -> list[int]:
        """Calls of ``command`` on each master since the last :meth:`reset_stats`."""
        return [int(c.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)) for c in self.node_clients()]

    def reset_stats(self) -> None:
        for c in self.node_clients():
            c.config_resetstat()


class SentinelExited(RuntimeError):
    """A sentinel process of a :class:`SentinelSet` exited while the set was starting (its port was taken)."""


class SentinelSet:
    """A master, one replica and three sentinels (quorum 2), all on loopback.

    ``down_after_ms`` is short so a killed master is failed over in a few
    seconds; the sentinels write their own config files in a private directory.
    """

    NAME = "lockmaster"

    def __init__(self, down_after_ms: int = 800, sentinels: int = 3) -> None:
        self.down_after_ms = down_after_ms
        # No 5 s wait for more replicas before a full sync (the default diskless-sync delay).
        self.master = RedisServer(extra=["--repl-diskless-sync-delay", "0"])
        self.replica = RedisServer(extra=["--repl-diskless-sync-delay", "0"])
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.dir = Path(tempfile.mkdtemp(prefix="lockguard-sentinel-"))
        self.sentinel_procs: list[subprocess.Popen[bytes]] = []

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.sentinel_ports]

    def start(self) -> SentinelSet:
        try:
            self.master.start()
            self.replica.extra += ["--replicaof", "127.0.0.1", str(self.master.port)]
            self.replica.start()
            wait_for(self._replica_in_sync, 20, interval=0.05, what="the replica to sync")
            # A sentinel whose port was taken between free_port() and its bind (an ephemeral port of some
            # client's connection) exits at once: start the set again on fresh ports, at most twice.
            for attempt in range(3):
                self._start_sentinels()
                try:
                    wait_for(self._sentinels_agree, 60, interval=0.1, what="the sentinels to see each other")
                    break
                except SentinelExited:
                    if attempt == 2:
                        raise
                    self._stop_sentinels()
                    self.sentinel_ports = [free_port() for _ in self.sentinel_ports]
        except BaseException:
            self.close()
            raise
        return self

    def _start_sentinels(self) -> None:
        """One process per port, each told its own id, its peers and the replica up front, so the set is
        ready at once instead of after rounds of hello messages (every 2 s); each logs to the private dir."""
        ids = {port: uuid.uuid4().hex + uuid.uuid4().hex[:8] for port in self.sentinel_ports}
        for port in self.sentinel_ports:
            conf = self.dir / f"sentinel-{port}.conf"
            peers = "".join(
                f"sentinel known-sentinel {self.NAME} 127.0.0.1 {p} {ids[p]}\n"
                for p in self.sentinel_ports
                if p != port
            )
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.dir}\n"
                f"logfile {self.dir / f'sentinel-{port}.log'}\n"
                f"sentinel myid {ids[port]}\n"
                f"sentinel monitor {self.NAME} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.NAME} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.NAME} 10000\n"
                f"sentinel parallel-syncs {self.NAME} 1\n"
                f"sentinel known-replica {self.NAME} 127.0.0.1 {self.replica.port}\n" + peers
            )
            self.sentinel_procs.append(
                subprocess.Popen(
                    [server_binary(), str(conf), "--sentinel"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )

    def _stop_sentinels(self) -> None:
        for proc in self.sentinel_procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.sentinel_procs.clear()

    def sentinel_client(self, i: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.sentinel_ports[i], decode_responses=True, socket_timeout=2)

    def _replica_in_sync(self) -> bool:
        """Linked, and acknowledging writes (WAIT sees it: the first ACK comes a moment after the sync)."""
        if self.replica.client().info("replication").get("master_link_status") != "up":
            return False
        m = self.master.client()
        m.set("topologies:probe", "1")
        return int(m.execute_command("WAIT", 1, 100)) >= 1

    def _sentinels_agree(self) -> bool:
        exited = [
            p for p, proc in zip(self.sentinel_ports, self.sentinel_procs, strict=True) if proc.poll() is not None
        ]
        if exited:
            logs = {p: (self.dir / f"sentinel-{p}.log") for p in exited}
            tails = {p: log.read_text(errors="replace")[-300:] if log.exists() else "" for p, log in logs.items()}
            raise SentinelExited(f"sentinels on ports {exited} exited: {tails}")
        for i in range(len(self.sentinel_ports)):
            try:
                state = self.sentinel_client(i).sentinel_master(self.NAME)
            except redis.exceptions.RedisError:
                return False
            if int(state.get("num-other-sentinels", 0)) != len(self.sentinel_ports) - 1:
                return False
            if int(state.get("num-slaves", 0)) < 1:
                return False
        return True

    def master_port(self, i: int = 0) -> int:
        """The master's port as sentinel ``i`` reports it now."""
        return int(self.sentinel_client(i).sentinel_get_master_addr_by_name(self.NAME)[1])

    def close(self) -> None:
        self._stop_sentinels()
        for server in (self.master, self.replica):
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)  # a test may have frozen it
            server.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SentinelSet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

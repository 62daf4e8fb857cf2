"""A private three-master Redis Cluster on loopback, for the cluster cost figure: the library's own.

The bench never imports ``tests/``; :class:`celery_lockguard.testing.LocalCluster` serves both.
"""

from __future__ import annotations

from celery_lockguard.testing import LocalCluster

__all__ = ["LocalCluster"]

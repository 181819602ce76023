"""A mesh that several e2e modules share, each module with its own router flags."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.cli.mesh import Mesh


class SharedMesh:
    """A mesh started by its first user, given each user's router flags (the
    router restarted on its ports when they differ), and stopped by its last
    user module (:meth:`stop`) or at the end of the session; a user after a
    stop starts a new one.

    Args:
      build: the (unstarted) mesh for the given router flags.
    """

    def __init__(self, build: Callable[[Sequence[str]], Mesh]) -> None:
        self._build = build
        self._mesh: Mesh | None = None

    def get(self, router_args: Sequence[str]) -> Mesh:
        """The running mesh, its router running with ``router_args``."""
        if self._mesh is None:
            self._mesh = self._build(router_args).start()
        elif tuple(self._mesh.router_args) != tuple(router_args):
            self._mesh.restart_router(router_args)
        return self._mesh

    def stop(self) -> None:
        if self._mesh is not None:
            self._mesh.stop()
            self._mesh = None

    def __enter__(self) -> SharedMesh:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

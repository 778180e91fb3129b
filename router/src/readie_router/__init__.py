"""readie router: places jobs and sessions on readie workers, over gRPC.

Public: :mod:`readie_router.cli` (``readie router``). Everything else is
private: placement over the members (``_placement``, ``_members``, ``_roster``,
``_placed_session``), finding workers by DNS (``_discovery``), and the Pool
gRPC service (``_pool_service``), which runs ``readie_pool``'s engine on
the placement.
"""

__all__: list[str] = []

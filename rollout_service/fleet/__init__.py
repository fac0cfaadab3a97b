"""The engine fleet: the one owner of the engine actors (control plane below the refit controller).

- ``health``        — engine health as a pure state machine (no Ray): serving set, epoch, replacements.
- ``placement``     — one placement group per engine (its GPUs / TP group, its node).
- ``fleet``         — the ``EngineFleet`` actor and its life cycle; publishes ``FleetView``s. Its mixins:
  ``monitor`` (probes, deaths, replacements), ``bring_up`` (an engine started in a slot),
  ``refit_bracket`` (the refit bracket and the durable record of it, ``ledger``), ``adoption`` (a new
  incarnation takes over its predecessor's engines), ``current_weights`` (what a replacement loads).
- ``data_plane_reports`` — the data plane's canary figures and pin moves, kept in the fleet actor.
- ``client``        — ``FleetClient``: the data plane's pickle-safe view (handles + epoch + routing).
"""

"""Routing across replicas (SPEC §14): the reference index over KV events (index.py), the routing
policies (policies.py), a replica's pool and events (replica.py), a trace served by N replicas
behind a router and checked (route.py), Dynamo's RadixTree beside the reference (dynamo.py, opt-in),
and the charts and grids of routed runs (report.py)."""

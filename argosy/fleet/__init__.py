"""Argosy as a fleet on Ray: one head (the normal HTTP server, every dialect) and engine nodes
(Ray actors), behind the same EngineClient seam as a local engine. Optional: `argosy[fleet]`."""

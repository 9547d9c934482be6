"""Device meshes, logical-axis shardings and multi-process runs."""

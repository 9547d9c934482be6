"""Device meshes, logical-axis shardings and multi-process runs.

`mesh` (MeshConfig, make_mesh), `rules` (logical axes -> NamedSharding), `abstract` (sharded ShapeDtypeStructs,
bytes per device), `sharded_forward`, `distributed` (multi-process). Their public names are re-exported here, so
`from jopd import parallel as meshlib` reaches all of them (`distributed` is imported on its own).
"""

from jopd.parallel.abstract import sharded_abstract, sharded_bytes_per_device
from jopd.parallel.mesh import MESH_AXES, OPTIONAL_AXES, MeshConfig, OnIndivisible, make_mesh, resolve_mesh_shape
from jopd.parallel.rules import (SAMPLE_RULES, TRAIN_RULES, AxisRules, MeshAxes, activation_sharding, batch_sharding,
                                 cache_logical_axes, logical_to_sharding, logical_to_spec, param_shardings, rules_for,
                                 unstacked_layer_shardings)
from jopd.parallel.sharded_forward import make_sharded_forward

__all__ = ["MESH_AXES", "OPTIONAL_AXES", "SAMPLE_RULES", "TRAIN_RULES", "AxisRules", "MeshAxes", "MeshConfig", "OnIndivisible",
           "activation_sharding", "batch_sharding", "cache_logical_axes", "logical_to_sharding", "logical_to_spec",
           "make_mesh", "make_sharded_forward", "param_shardings", "resolve_mesh_shape", "rules_for",
           "sharded_abstract", "sharded_bytes_per_device", "unstacked_layer_shardings"]

"""core: the layer plan and footprint (geometry), the ring (positions -> rows,
no MLX), planes, the kernels (reference path and custom kernels), the planes'
dtype, count arguments. Imports nothing else of muser-kv, and no mlx-lm."""

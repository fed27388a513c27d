"""Device slices, meshes and the logical-axis sharding rules (`parallel.sharding`)."""

"""What every stage shares and declares once: the tensor contracts and a build's layout (`contracts`), the serving
limits (`limits`), a build's manifest (`manifest`), dtype names and their torch dtypes (`dtypes`, `torch_dtypes`),
atomic output directories (`fsutil`). Imports nothing else of the package but its errors."""

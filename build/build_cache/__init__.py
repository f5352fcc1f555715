"""The shared build cache (build time: `build --cache`, `build-key`, `cache list|prune`): a build key from
everything that makes the artifacts differ (key), the checkpoint's digest (digest), entries published atomically
with a manifest of their files and pulled checked (store), and the lease that lets one builder of a key work while
the others wait (lease). Imports the toolchain's leaf modules only; the pipeline drives it."""

"""The repository around the package: import layers (docs/architecture.md), docs, versions, private APIs, benchmarks,
examples, the architecture sweep."""

"""Expert parallelism: a mixture of experts' experts split over the ep ranks (docs/moe.md)."""

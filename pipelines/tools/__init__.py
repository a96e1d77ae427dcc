"""The commands around a job: `overnight doctor`, `tiny-model`, the demo model."""

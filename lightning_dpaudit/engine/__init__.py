"""The audit of an Opacus DPOptimizer (torch and Opacus, no Lightning): the audited step's
pipeline, the canary kinds, the release paths, saved state."""

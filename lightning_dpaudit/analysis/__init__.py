"""A run's statistics, without torch: the anytime monitor, the observation log, noise
fingerprints, findings, the result records and the report."""

"""The audit where users train: the Lightning callback, the test-suite helper, the bug zoo
and the bundled digits data and model."""

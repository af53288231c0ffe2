"""The `dpaudit` command: demo, report, bug list."""

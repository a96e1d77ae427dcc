"""The job's run: the Ray Data pipeline assembled, where it runs, its progress and its watchdog."""

"""The job's plan: every check that needs no engine, the specs the engines are built from, the fingerprint."""

"""sokratos-worker: durable background pipelines for the Sokratos personal assistant."""

__version__ = "0.1.0"

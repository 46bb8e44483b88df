"""plancache: tune cuDNN Frontend graphs once per GPU environment, serve the winning plans to every process."""

__version__ = "0.1.0"

#: Version of the GraphSpec schema; part of every graph key.
SPEC_SCHEMA_VERSION = 2

"""specexport: compile speculative-decoding engines (exporter) and run them losslessly (runtime)."""

__version__ = "0.1.0"

"""Example cuDNN Frontend (FE 1.32) ``cudnn.pygraph`` graphs: see ``graphs.EXAMPLES`` and README.md."""

"""torch.compile support for the tc_piecewise CUDA-graph backend: the graph-splitting pass, the
Dynamo backend that compiles the pieces, and the entry point that compiles a model's forward."""

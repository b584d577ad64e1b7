"""Inference planning (zplan compile --mode inference): the serving cost model and the choice of tensor-parallel
degree, weight precision and weight tier."""

"""Studies: grids of training runs, their analyses, findings and the report."""

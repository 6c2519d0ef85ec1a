"""Studies: grids of training runs, their analyses, findings and the report; and the search
(:mod:`kilolayer.study.search`), which races parameter-matched shapes of one config instead of training a grid."""

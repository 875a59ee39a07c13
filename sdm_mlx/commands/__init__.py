"""One module per ``sdm-mlx`` verb (see ``sdm_mlx.cli``): each has ``HELP``, ``add_arguments`` and ``run``,
plus optional ``REQUIRED`` and ``SETTINGS``; pieces two verbs share live in :mod:`._common`.

The top layer: a verb may import any package below it, but never the dispatcher (:mod:`sdm_mlx.cli`) nor
another verb (``tests/house/test_import_graph.py`` checks both).  Heavy imports happen inside ``run`` so that
building the parser for ``--help`` stays instant.
"""

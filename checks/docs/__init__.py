"""The reviewer docs: pages generated from the spec registries and the Sphinx extension that renders them.

:mod:`decodespec.checks.docs.pages` generates the pages, stages them with the hand-written ones
and builds the site (``decodespec docs``); :mod:`decodespec.checks.docs.extension` is the Sphinx
extension ``docs/conf.py`` loads.
"""

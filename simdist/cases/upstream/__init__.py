"""Upstream packages for the DeepSpeed defects simdist found: standalone reproducer, fix diff, report.

``simdist case export production DIR`` writes them (`simdist.cases.upstream.packages.export`).
"""

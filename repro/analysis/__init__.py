"""The statistics and tables: intervals and paired tests (``intervals``: bootstrap intervals over
documents or BBQ contexts, McNemar's exact test, Tango's interval, the sign-flip test, Holm),
per-document records (``documents_file``), differences from the Vanilla row (``differences``) and the
rendered tables with the paper's numbers beside ours (``tables``). (Not named ``statistics``: a
table script run as a file has repro/ first on sys.path, where that name would hide Python's own.)

May import: ``repro.engine``.
"""

"""The injection site: how a transformer's decoder layers are reached and a state edited in
place by a forward hook that composes with accelerate's (``site``: the hook that edits the residual
stream; ``layer_spans``: a pass run from one layer to another), where the frozen model computes
(``devices``), and what a method hands the runner (``plan``: the variants of an edit at the site).

May import: nothing else of mari_eval (a module here knows layers and tensors, not methods).
"""

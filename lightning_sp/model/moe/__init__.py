"""The mixture-of-experts feed-forward part, in one folder: its settings (:mod:`.config`), the
router (:mod:`.router`), one rank's grouped experts (:mod:`.experts`), the layer that routes,
dispatches over the expert-parallel group and combines (:mod:`.layer`), the step's routing
metrics (:mod:`.metrics`), and the part that states its bytes, GEMMs, FLOPs and weight names
(:mod:`.part`). Nothing outside ``model/`` and ``interop/`` imports this folder: the training
loop, the pipeline and checkpoints reach it through the generic module hooks."""

"""Everything that pushes a batch through the model, in one place (imports nothing, so that the
torch-free rules load without torch):

    schedules.py   the pipeline's rules and refusals, torch-free; StageLayout, this rank's share
    cutting.py     a rank's stages built (the one way a model is cut)
    engine.py      torch.distributed.pipelining's schedule over them
    runner.py      the step runner: LocalRunner at pp 1, PipelinedRunner otherwise (make_runner)
"""

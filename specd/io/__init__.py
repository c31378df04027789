"""specd's contact with the world: the SGLang reader, the applier and its one subprocess
runner, config/override/state files, metrics, logs and sd_notify."""

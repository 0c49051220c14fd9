"""Where prompts and rewards come from: the dataset environment, files, rewards, prompts."""

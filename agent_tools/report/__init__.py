"""The main job's outputs: the full analysis run, its terminal rendering, PNG pictures and the HTML report."""

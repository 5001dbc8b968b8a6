"""Critics: the learned value model and the Monte-Carlo critic (values from env rollouts)."""

"""What several test modules share: helpers, and fixtures registered in conftest."""

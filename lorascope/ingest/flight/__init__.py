"""torch's flight-recorder dumps (pickle or JSON): reading."""

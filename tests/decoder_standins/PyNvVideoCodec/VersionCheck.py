"""The wheel's VersionCheck extension: the NVENC API version the installed driver supports (major * 16 + minor)."""


class DriverWrapper:
    def GetDriverVersion(self) -> int:  # upstream's name
        return 13 * 16  # NVENC 13.0: a driver of the CUDA 13 era

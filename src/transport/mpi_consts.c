/* Constants that rsmpi's bindings do not expose; compiled with mpicc by build.rs. */
#include <mpi.h>
void *const FERROVOD_MPI_IN_PLACE = MPI_IN_PLACE;
const MPI_Datatype FERROVOD_MPI_BYTE = MPI_BYTE;
